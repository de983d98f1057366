"""The `zeroshard` command line: thin subcommands over the library."""
