"""The platform's SQLite database backend (``DATABASES["default"]["ENGINE"]``); see :mod:`.base`."""
