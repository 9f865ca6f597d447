"""Integrations with training and tracking libraries, each importing its library only when used:

    from moecompile.integrations.lightning import MoECallback      # pip install 'moecompile[lightning]'
    from moecompile.integrations.mlflow import log_routing_stats    # pip install 'moecompile[mlflow]'
"""
