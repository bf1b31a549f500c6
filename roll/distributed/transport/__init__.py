"""The model update's wire: buckets, checksums, process groups, broadcast, IPC and links.

The lowest layer of ``roll/distributed``: it imports nothing else from ``roll.distributed``, so
the engines' own processes (``strategy``) and the update groups (``model_update``) build both ends
of a link from the same pieces.
"""
