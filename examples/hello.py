import math

n = int(input() or 5)
print(math.factorial(n))
