"""Dispatch policies: one module per policy, one registry (``registry.py``) mapping names to factories.

Policies do no I/O and import only ``extproc.policies.base`` and the stdlib, so the cluster benchmark can run
the very same code in virtual time.
"""
