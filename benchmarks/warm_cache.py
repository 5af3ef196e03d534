"""The stand-in sm_90 driver moved to benchmarks/tools.py (`python benchmarks/tools.py warm` packs a cache); this
name stays for the scripts that still import it (tests/test_triton_pipeline.py, benchmarks/pipeline_check.py)."""
from tools import install_sm90  # noqa: F401
