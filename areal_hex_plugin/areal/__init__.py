"""Everything that imports upstream AReaL: config subclass, driver pieces, schedulers, controllers, engines."""
