"""Signed attestations of a published image: a CycloneDX SBOM and an in-toto/SLSA provenance
statement, each in a DSSE envelope signed with the user's key, attached to the image's manifest digest
in the registry as OCI referrer artifacts; and their verification.

Parts: sbom.py (what the image holds), provenance.py (how it was made), dsse.py (envelopes, keys),
referrers.py (the registry side).
"""
