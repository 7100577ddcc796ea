"""What workflows take, return and receive (inputs, results, signals, updates, queries),
shared by the workflows, the activities they call and everyone who starts them."""
