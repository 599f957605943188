from tilegen.cli import main

main()
