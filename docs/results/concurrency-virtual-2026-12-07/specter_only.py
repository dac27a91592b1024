"""`specter` and `specter kept` alone on the concurrency bench's workload (the embedded moe-fine and its
AWQ draft, the 8 held-out prompts, 64 new tokens, N = 1, 2, 4, 8), on a clock and with a number of
requests per client the command line does not take: python specter_only.py PROFILES CLOCK PER_CLIENT."""

import sys

import torch

from specter.assets import DEFAULT_DRAFT, DEFAULT_MODEL
from specter.eval import concurrency
from specter.eval.prompts import load_prompts

torch.set_num_threads(2)
model = str(DEFAULT_MODEL)
config = concurrency.ConcurrencyConfig(model, load_prompts(model, None, 8), sys.argv[1].split(","), ["specter"],
                                       [1, 2, 4, 8], 64, clock=sys.argv[2], requests_per_client=int(sys.argv[3]),
                                       draft=str(DEFAULT_DRAFT), kept=True)
print(concurrency.table(concurrency.run(config)))
