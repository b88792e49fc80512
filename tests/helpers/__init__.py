"""What several test modules share besides conftest's fixtures: each module here is one kind of
helper, imported by the test modules that need it (``from helpers.fake_pool import FakePool``)."""
