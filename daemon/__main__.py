from stoker.daemon.cli import main

main()
