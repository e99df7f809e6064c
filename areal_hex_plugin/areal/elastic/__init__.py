"""Elastic rollout (``hex.elastic``): rollout servers lost and gained mid-run, machines that join, and output lengths
that drift. :class:`~areal_hex_plugin.areal.elastic.rollout.ElasticRollout` ties together the servers' health
(``health.py``), their shares (``shares.py``) and length drift (``drift.py``)."""

from areal_hex_plugin.areal.elastic.health import DOWN, JOINING, UP, http_probe
from areal_hex_plugin.areal.elastic.rollout import ElasticRollout, attach_elastic, output_lengths

__all__ = ["DOWN", "JOINING", "UP", "ElasticRollout", "attach_elastic", "http_probe", "output_lengths"]
