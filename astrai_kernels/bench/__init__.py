"""``astrai-kernels bench``: time and peak memory of every op and method, shared by the CLI and
the pytest-benchmark suite in ``bench/``. One module per role:

* :mod:`.cases`: the ops, methods, :class:`~.cases.Case`, the default point sets, planning.
* :mod:`.workloads`: what every case's workload shares (the timed call, the naive steps).
* :mod:`.logits`: the logits ops' inputs and calls.
* :mod:`.linear`: the fused-LM-head ops' inputs and calls, their baselines and GEMM floor.
* :mod:`.peak`: peak resident memory on Linux.
* :mod:`.step_cases`: what the step benchmarks share (fresh processes, best-of timing).
* :mod:`.strategy_steps`: one optimizer step of each strategy (``bench/bench_strategies.py``).
* :mod:`.measure`: one case in this process (its workload picked by op): time, peak memory,
  the same-run copy floor.
* :mod:`.runner`: each case in a process of its own (fork server or fresh interpreter).
* :mod:`.report`: ratios, machine block, progress bar, tables, JSON; :mod:`.plot`: the plot.
* :mod:`.suite`: the whole run (cases, strategies' steps, ``torch.compile`` cases, deadline).
"""
