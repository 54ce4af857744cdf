"""radixkv's sidecar: one prefix cache for every process of a machine (docs/sidecar.md).

``python -m radixkv.sidecar --socket PATH --host-bytes N`` runs it (``server``: the socket loop,
``state``: pools, trees and clients' leases, ``layout``: where bytes sit in shared memory,
``protocol``: the frames, ``messages``: the request schema, ``metrics``: Prometheus text,
``l2_writer``: write-through to the L2 tier). ``client.SidecarTier`` is what a ``KVStore`` holds to use one (``connection``: its socket,
framed requests under deadlines; ``write_through``: its background writer; ``shared_view``: its
``BlockPool`` over the mapped shared memory).
"""
