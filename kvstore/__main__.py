"""`python -m kvstore ...`: the `kvstore` command."""

from kvstore.cli.main import main

if __name__ == "__main__":
    main(prog_name="kvstore")
