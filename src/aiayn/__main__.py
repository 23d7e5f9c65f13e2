from aiayn.cli import entry

entry()
