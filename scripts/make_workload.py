"""Regenerate data/mixed_workload.json: the mixed request lengths Chapters 7 and 9 measure with.

Prompt lengths are log-normal (most prompts short, a few long, as in chat traffic); output
budgets are drawn from a few common max_tokens values, and the length a request actually
produces is a uniform fraction of its budget (answers stop early at EOS). Seeded, so the
committed file is reproducible: `python scripts/make_workload.py`.
"""

import json
import math
import random
from pathlib import Path

SEED, N = 7, 64
MAX_PROMPT, BUDGETS = 480, (32, 64, 128, 256)


def main() -> None:
    rng = random.Random(SEED)
    requests = []
    for _ in range(N):
        prompt = min(MAX_PROMPT, max(8, round(math.exp(rng.gauss(math.log(60), 0.9)))))
        budget = rng.choice(BUDGETS)
        output = max(1, round(budget * rng.uniform(0.25, 1.0)))
        requests.append({"prompt_tokens": prompt, "max_tokens": budget, "output_tokens": output})
    out = {"description": __doc__.strip().splitlines()[0], "seed": SEED,
           "max_prompt_tokens": MAX_PROMPT, "max_tokens_choices": list(BUDGETS), "requests": requests}
    path = Path(__file__).resolve().parent.parent / "data" / "mixed_workload.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path} ({N} requests)")


if __name__ == "__main__":
    main()
