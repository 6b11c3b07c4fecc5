"""mopt in-image runtime: compile an embedding engine, guard it, serve it.

Ships inside images as /opt/mopt/mopt_runtime (``python -m mopt_runtime``) and runs unchanged
on a GPU host as ``python -m builder.runtime``; hence relative imports only and no build-side deps.
"""

SCHEMA_VERSION = 1
