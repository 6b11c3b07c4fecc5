"""Publishing to a container registry: references (reference.py), credentials from docker's config
(credentials.py), the registry HTTP API (api.py), pushing with the docker CLI (push.py), and the release
phases that use them (phases.py: every long tag verified before any short tag moves)."""
