"""`python -m lowbit ...` (e.g. `torchrun --nproc-per-node 2 -m lowbit quantize ... --distributed`)."""
import sys

from lowbit.entrypoints.main import main

sys.exit(main())
