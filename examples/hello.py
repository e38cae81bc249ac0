import math
import sys

n = int(sys.stdin.read().strip() or 5)  # no input: 5
print(math.factorial(n))
