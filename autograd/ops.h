// The differentiable API (namespace tally: what users and layers call), every op family in
// one include. Declares nothing itself: each family's differentiable ops are in
// tensor/<family>/autograd.h (forward, what is saved, backward in its autograd.cpp). Code
// inside tensor/ includes the family headers it needs, never this one.
#pragma once

#include "tensor/attention/autograd.h"
#include "tensor/compose/autograd.h"
#include "tensor/conv/autograd.h"
#include "tensor/elementwise/autograd.h"
#include "tensor/index/autograd.h"
#include "tensor/linalg/autograd.h"
#include "tensor/norm/autograd.h"
#include "tensor/pool/autograd.h"
#include "tensor/reduce/autograd.h"
#include "tensor/rnn/autograd.h"
#include "tensor/shape/autograd.h"
#include "tensor/softmax/autograd.h"
