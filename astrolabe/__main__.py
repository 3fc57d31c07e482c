from astrolabe.cli import main

raise SystemExit(main())
