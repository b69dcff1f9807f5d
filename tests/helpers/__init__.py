"""What the tests share: fakes, channels, reference outputs and writers. Test modules import from here, never
from one another or from a conftest."""
