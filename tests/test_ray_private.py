"""The private Ray APIs kava-ray uses (`kava_ray.runtime.ray_private`): still there, on the Ray they were checked
against. A Ray upgrade fails here first, with the file to re-check named."""

import pytest
import ray

from kava_ray.runtime.ray_private import RAY_VERSION, missing

pytestmark = pytest.mark.unit


def test_the_private_ray_apis_are_still_there():
    assert missing() == [], f"Ray {ray.__version__} lacks {missing()}: re-check kava_ray/runtime/ray_private.py"


def test_the_installed_ray_is_the_one_they_were_checked_against():
    assert ".".join(ray.__version__.split(".")[:2]) == RAY_VERSION, (
        f"Ray {ray.__version__} is installed, kava_ray/runtime/ray_private.py was written against {RAY_VERSION}: "
        f"re-check its three private APIs, then update RAY_VERSION")
