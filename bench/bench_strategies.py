"""One optimizer step of each training strategy, fused losses against the seed's math: the
command line of :mod:`astrai_kernels.bench.strategy_steps` (its docstring says what is measured).

    python bench/bench_strategies.py                    # V=32768, every strategy and method
    python bench/bench_strategies.py --vocab 4096 --strategies seq,grpo --inplace
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: this checkout's package
    sys.path.insert(0, ROOT)

from astrai_kernels.bench.strategy_steps import main  # noqa: E402

if __name__ == "__main__":
    main()
