"""The notebooks' interactive explorers: ``ipywidgets.interact`` when a person runs the notebook, one
plain call at the explorer's default arguments in fast mode (CI, nbmake).

Run without a browser, a cell that builds widgets now and then never completes for the notebook
client: the kernel sits idle, nbclient waits for a reply that does not come (jupyter/nbclient#312; seen
in minispec's CI on the ``interact`` cells, with ipykernel 6 and 7). Fast mode therefore builds no
widget at all and draws each explorer once, so the cell's code still runs and is checked.
"""

from __future__ import annotations

from .. import config


def interact(fn, **controls):
    """``ipywidgets.interact(fn, **controls)`` (controls in its abbreviations: ``(min, max[, step])`` for
    a slider, a list for a choice; the start values are ``fn``'s defaults); in fast mode ``fn()``."""
    if config.fast():
        return fn()
    import ipywidgets

    return ipywidgets.interact(fn, **controls)
