"""Measure batch invariance of the default GPU path: a prompt alone vs among random siblings (max |dlogit|)."""

import random
import sys

import numpy as np

from basal_local.api.systemone import validate_systemone
from basal_local.backends.torch import TorchBackend
from basal_local.bench import sample_requests
from basal_local.engine.packer import PromptSpec, pack_prompts
from basal_local.model import load_model_dir
from basal_local.protocol.render import render_question


def main(model_dir: str, dtype: str = "auto") -> None:
    md = load_model_dir(model_dir)
    backend = TorchBackend("cuda")
    backend.load(md.path, dtype)
    prefixes = {lang: md.tokenizer.template_prefix(lang) for lang in ("pl", "en")}
    for lang, ids in prefixes.items():
        backend.add_prefix(lang, ids)
    specs = []
    for item in sample_requests():
        request = validate_systemone({**item, "model": md.name}, md.name)
        for q in request.questions:
            lang, _, prompts = render_question(request.state_text, q)
            specs += [PromptSpec(md.tokenizer.encode(p), lang, md.tokenizer.letter_ids[: len(q.keys)]) for p in prompts]
    rng = random.Random(0)
    worst, bitwise = 0.0, 0
    trials = 20
    for _ in range(trials):
        target = rng.choice(specs)
        pack = pack_prompts([target], prefixes)
        alone = backend.forward(pack.batches[0])[pack.readouts[0][1], pack.readouts[0][2]]
        siblings = rng.sample(specs, rng.randint(4, 40))
        pack = pack_prompts(siblings + [target], prefixes)
        b, r, cols = pack.readouts[-1]
        mixed = backend.forward(pack.batches[b])[r, cols]
        worst = max(worst, float(np.abs(mixed - alone).max()))
        bitwise += int(np.array_equal(mixed, alone))
    print(f"{md.name} {backend.dtype_name}: alone vs with siblings over {trials} trials: "
          f"max |dlogit| {worst:.3g}, bitwise equal {bitwise}/{trials}")


if __name__ == "__main__":
    main(*sys.argv[1:])
