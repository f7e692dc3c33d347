// stub: to be implemented
