"""utilities shared by capabilities and tools, importing nothing of gradsafe above gradsafe.patching"""
