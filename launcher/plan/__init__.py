"""The planner: memory per GPU (:mod:`.memory`), step time and layout ranking
(:mod:`.costmodel`), and ``python -m launcher.plan`` (:mod:`.cli`). Pure: no torch."""
