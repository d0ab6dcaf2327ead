"""The plan as a value: the solver's choice in, a ``Plan`` and the words that show it out.

- ``plan``      the ``Plan``: placements, collectives, time, memory; saved and loaded as JSON
- ``report``    the plan as text, JSON or HTML
- ``explain``   each placement a module's weight could have, solved again and priced
- ``expert_choice`` where the routed experts went and each other placement, solved again and priced
"""
