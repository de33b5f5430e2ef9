"""Data-parallel attention + expert-parallel MoE over the devices of a host (or several).

``mesh``: the (chip, die) device mesh and the static EP context the model step reads;
``dp_forward``: the model step under ``shard_map``, each device running its own requests.
"""
