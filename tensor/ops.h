// The raw API (namespace tally::ops: computation without autograd), every op family in one
// include. Declares nothing itself: each family's ops are in tensor/<family>/ops.h, the
// core (factories, copies, views, elementwise) in tensor/elementwise/ops.h. Code inside
// tensor/ includes the family headers it needs, never this one.
#pragma once

#include "tensor/attention/ops.h"
#include "tensor/conv/ops.h"
#include "tensor/elementwise/ops.h"
#include "tensor/index/ops.h"
#include "tensor/linalg/ops.h"
#include "tensor/norm/ops.h"
#include "tensor/pool/ops.h"
#include "tensor/reduce/ops.h"
#include "tensor/rnn/ops.h"
#include "tensor/shape/ops.h"
#include "tensor/softmax/ops.h"
