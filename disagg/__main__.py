from disagg.cli import main

raise SystemExit(main())
