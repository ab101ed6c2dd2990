from freetoken.cli.app import main

main()
