"""AReaL-Hex: asynchronous RL on heterogeneous GPU clusters, as a plugin for upstream AReaL.

The core (``specs``, ``costmodel``, ``scheduler``, ``plan``, ``sim``) imports neither ``areal`` nor
``torch``; only ``areal_hex_plugin.areal`` and ``areal_hex_plugin.transport`` do.
"""

__version__ = "0.1.0"
