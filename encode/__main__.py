from encode.cli import main

main()
