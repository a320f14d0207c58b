"""The gloo test harness (``astrai_kernels.testing.multiprocess.spawn_ranks``) on 2 CPU ranks:
a rank that raises, dies by a signal or hangs fails the call within seconds with that rank's
traceback or stack, never a hang or a bare exit code. (Its results in rank order are what every
distributed test reads.)"""

import os
import time

import pytest
import torch
import torch.distributed as dist

from astrai_kernels.testing.multiprocess import RankFailed, spawn_ranks


def _rank1_raises(rank, world_size):
    if rank == 1:
        raise ValueError("rank 1 lost its shard")
    dist.all_reduce(torch.ones(1))  # left waiting for rank 1
    return rank


def _rank1_aborts_in_native_code(rank, world_size):
    if rank == 1:
        os.abort()  # as a C++ std::terminate does
    return rank


def _rank1_sleeps_forever(rank, world_size):
    if rank == 1:
        time.sleep(3600)
    return rank


def test_raising_rank_is_reported_with_its_traceback():
    started = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1 raised") as failure:
        spawn_ranks(_rank1_raises, 2, timeout=60.0)
    assert "ValueError: rank 1 lost its shard" in str(failure.value)
    assert "_rank1_raises" in str(failure.value)
    assert time.monotonic() - started < 45.0


def test_rank_killed_by_a_signal_is_reported_with_its_stack():
    with pytest.raises(RankFailed, match="rank 1 died by signal SIGABRT") as failure:
        spawn_ranks(_rank1_aborts_in_native_code, 2, timeout=60.0)
    # the Python stack faulthandler wrote when the signal arrived
    assert "_rank1_aborts_in_native_code" in str(failure.value)


def test_hung_rank_is_killed_after_the_timeout():
    started = time.monotonic()
    # rank 0 waits in the teardown barrier for rank 1
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 still running after 8 s"
                       ) as failure:
        spawn_ranks(_rank1_sleeps_forever, 2, timeout=8.0)
    stuck = str(failure.value).split("rank 1:")[1]
    assert "_rank1_sleeps_forever" in stuck  # where it was stuck
    assert time.monotonic() - started < 30.0


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        spawn_ranks(_rank1_raises, 0)
    with pytest.raises(ValueError, match="timeout"):
        spawn_ranks(_rank1_raises, 2, timeout=0.0)
    with pytest.raises(ValueError, match="group_timeout"):
        spawn_ranks(_rank1_raises, 2, group_timeout=0.0)
