"""lightning_accel's Hydra config tree (`pkg://lightning_accel.conf`).

Hydra imports this package when it opens the tree, for accel-train and for any app whose search path holds it (the
search-path plugin, or `hydra.searchpath` in the app's config): the options' schemas (`lightning_accel.schema`) are
registered in Hydra's ConfigStore here, before any option's defaults list names one.
"""

from lightning_accel.schema import register_schemas

register_schemas()
