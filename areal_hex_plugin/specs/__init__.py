"""Inputs of the planner: GPU catalog, cluster inventory, model shapes, workload and recipe reading."""
