"""Calibrated splits (MoEfication-style): partition, fit routers, distill, evaluate."""
