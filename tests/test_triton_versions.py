"""The Triton version check at import of chunkwise.triton: one warning outside [3.6.0, 3.10), none inside."""
import warnings

import pytest

from chunkwise import triton as ck_triton


@pytest.mark.parametrize("version", ["3.6.0", "3.7.1", "3.8.0", "3.9.0", "3.9.1+git1234"])
def test_tested_version_no_warning(version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ck_triton.check_triton_version(version)


@pytest.mark.parametrize("version", ["3.5.1", "3.10.0", "4.0.0"])
def test_untested_version_warns_once(version):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not ck_triton.check_triton_version(version)
    assert len(caught) == 1
    assert issubclass(caught[0].category, ck_triton.TritonVersionWarning)
    text = str(caught[0].message)
    assert version in text and "3.6.0" in text and "3.10" in text
