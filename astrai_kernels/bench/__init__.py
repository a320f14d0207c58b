"""``astrai-kernels bench``: time and peak memory of every op and method, shared by the CLI and
the pytest-benchmark suite in ``bench/``. One module per role:

* :mod:`.cases`: the ops, methods, :class:`~.cases.Case`, the default point sets, planning.
* :mod:`.workloads`: the logits ops' inputs and calls, the seed's naive math.
* :mod:`.linear`: the fused-LM-head ops' inputs and calls, their baselines and GEMM floor.
* :mod:`.peak`: peak resident memory on Linux (also used by ``bench/bench_strategies.py``).
* :mod:`.measure`: one case in this process: time, peak memory, the same-run copy floor.
* :mod:`.runner`: each case in a process of its own (fork server or fresh interpreter).
* :mod:`.report`: ratios, machine block, progress bar, tables, JSON; :mod:`.plot`: the plot.
* :mod:`.suite`: the whole run (cases, strategies' steps, ``torch.compile`` cases, deadline).
"""
