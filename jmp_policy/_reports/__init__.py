"""Reports: where a program does its work (`census`) and the precision debugger (`debugger`)."""
