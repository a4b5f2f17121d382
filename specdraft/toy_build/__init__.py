"""How the shipped toy target was built: its training recipe and the unlikelihood trainer.

Build tools, not product: nothing in specdraft imports this package except the
`specdraft toy-target` command (lazily, when that command runs).
"""
