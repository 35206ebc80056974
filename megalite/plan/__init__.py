"""Planning a run without a process group or a GPU: a layout is the `RunShape` validate derives
(layouts.layout), its memory (memory.py: parameters, gradients, optimizer state; activations.py)
and traffic (traffic.py) equal what megalite allocates and sends, and the layouts of a cluster
are searched (layouts.search) and ranked by an estimated step time (ranking.py). report.py
prints plans. docs/planner.md gives the formulas."""
