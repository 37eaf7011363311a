import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # docs_sessions, for the tests beside it
