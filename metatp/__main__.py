from metatp.cli import main

raise SystemExit(main())
