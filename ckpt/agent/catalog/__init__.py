"""Where bundles are found, recorded and committed: the store alone or the control plane.

base           the ``Catalog`` protocol that restore and persist talk to
store          store-only: the manifests in the store are the catalog
control_plane  through the control plane (``CKPT_SERVER``): attempts, fencing, lineage
"""
