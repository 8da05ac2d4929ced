"""Record the seeded-init fingerprints of mixers and model presets that have none yet, in
tests/data/init_fingerprints.json (what tests/test_paper_config.py pins, so that trained results
and checkpoints keep meaning the same when the code moves on).

    python scripts/record_init_fingerprints.py            # add the missing entries
    python scripts/record_init_fingerprints.py --check    # exit 1 if an entry is missing

Existing entries are never rewritten: they are the record a change of initialisation is caught
against. A new mixer gets "NAME" (the mixer with its defaults) and "model:PRESET" for each model
preset its spec defines (`MixerSpec.presets`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


def missing_entries(recorded: dict) -> dict[str, dict[str, list[float]]]:
    """Return the fingerprints of every registered mixer and model preset absent from `recorded`."""
    from helpers import default_mixer_state, default_model_state, init_fingerprint

    from hookmech.mixers import REGISTRY
    from hookmech.model_presets import MODEL_PRESETS

    wanted = {name: lambda name=name: default_mixer_state(name) for name in REGISTRY}
    wanted.update({f"model:{preset}": lambda preset=preset: default_model_state(preset) for preset in MODEL_PRESETS})
    return {key: init_fingerprint(state()) for key, state in wanted.items() if key not in recorded}


def main() -> None:
    from helpers import INIT_FINGERPRINTS

    recorded = json.loads(INIT_FINGERPRINTS.read_text())
    missing = missing_entries(recorded)
    if "--check" in sys.argv:
        if missing:
            print(f"no init fingerprint for {', '.join(sorted(missing))}: run {__file__}", file=sys.stderr)
            sys.exit(1)
        return
    # the file's own layout: sorted keys, one value a line
    text = json.dumps({**recorded, **missing}, indent=0, sort_keys=True)
    temporary = INIT_FINGERPRINTS.with_suffix(".json.tmp")
    temporary.write_text(text)
    temporary.replace(INIT_FINGERPRINTS)
    print(f"recorded {', '.join(sorted(missing)) or 'nothing (every entry exists)'}")


if __name__ == "__main__":
    main()
