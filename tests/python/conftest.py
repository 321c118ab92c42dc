import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_seed():
    # Fresh random inputs every run; the seed is printed on failure, and MIRAGE_TEST_SEED=<seed>
    # runs the tests with it again (pytest -k <the test>) to reproduce a failure.
    fixed = os.environ.get("MIRAGE_TEST_SEED")
    if fixed:
        torch.manual_seed(int(fixed))
        seed = int(fixed)
    else:
        seed = torch.seed()
    print(f"torch seed: {seed} (MIRAGE_TEST_SEED={seed} repeats it)")
    yield


@pytest.fixture
def one_thread():
    """torch on one CPU thread: the force-field tests run molecules of a few atoms, where intra-op
    threads only add overhead (10x on a busy 2-core machine). Modules use it with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
