"""Discrete-event simulation of AReaL's asynchronous RL loop on a HexPlan (no areal/torch imports)."""
