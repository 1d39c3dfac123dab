import pytest
from train_kit import make_shards


@pytest.fixture(scope="session")
def shards(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("shards"))
