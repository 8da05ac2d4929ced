"""The default seed of the examples: one value for every command and function that draws them.

Imports nothing (the command line reads it to show its defaults without importing torch).
"""

from __future__ import annotations

#: the seed of the examples `hookmech cache`, `patch`, `view`, `report`, `data` and `demo` (and
#: `hookmech.report.build_report`, `hookmech.view.sweep_page_data`, `hookmech.demo.run_demo`)
#: draw, ``task.sample(n, seed)``, when none is given. It is the seed of every number the docs and
#: fixtures/README.md publish, so their commands reproduce without ``--seed``. Not 0: an int seed s
#: draws what the seed sequence (s, 0) draws (numpy's `SeedSequence` pads with zeros), and (s, 0)
#: is the training set of a run trained with seed s (`hookmech train` defaults to seed 0), whose
#: key sequences seed-0 examples would repeat (docs/guide.md, "Seeds").
EXAMPLES_SEED = 1
